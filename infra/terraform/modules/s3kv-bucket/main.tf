data "aws_region" "current" {}

locals {
  # "prefix/" as seen by S3: the lifecycle filter, the object ARN and the
  # ListBucket condition all anchor on it, so "s3kv" never matches "s3kv-other/".
  key_prefix      = "${var.prefix}/"
  objects_arn     = "${aws_s3_bucket.this.arn}/${var.prefix}/*"
  use_kms         = var.kms_key_arn != null
  iam_policy_name = coalesce(var.iam_policy_name, "s3kv-${var.bucket_name}")
}

resource "aws_s3_bucket" "this" {
  bucket        = var.bucket_name
  force_destroy = var.force_destroy
  tags          = var.tags
}

resource "aws_s3_bucket_ownership_controls" "this" {
  count = var.manage_ownership_controls ? 1 : 0

  bucket = aws_s3_bucket.this.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "this" {
  count = var.manage_public_access_block ? 1 : 0

  bucket = aws_s3_bucket.this.id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  count = var.manage_encryption ? 1 : 0

  bucket = aws_s3_bucket.this.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = local.use_kms ? "aws:kms" : "AES256"
      kms_master_key_id = var.kms_key_arn
    }
    # Bucket Keys only apply to SSE-KMS; they cut KMS calls (and cost) per object.
    bucket_key_enabled = local.use_kms
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    id     = "s3kv-expire-and-abort-multipart"
    status = "Enabled"

    filter {
      prefix = local.key_prefix
    }

    expiration {
      days = var.expiration_days
    }

    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_incomplete_multipart_days
    }
  }
}

data "aws_iam_policy_document" "bucket" {
  # TLS only. Off only for a local server reached over plain http, which this statement would
  # lock out entirely (servers that enforce bucket policies, e.g. SeaweedFS, deny every call).
  dynamic "statement" {
    for_each = var.require_tls ? [1] : []

    content {
      sid     = "DenyInsecureTransport"
      effect  = "Deny"
      actions = ["s3:*"]
      resources = [
        aws_s3_bucket.this.arn,
        "${aws_s3_bucket.this.arn}/*",
      ]

      principals {
        type        = "*"
        identifiers = ["*"]
      }

      condition {
        test     = "Bool"
        variable = "aws:SecureTransport"
        values   = ["false"]
      }
    }
  }

  # Write once: an object under the prefix can only be created with If-None-Match, so nobody
  # (engine, operator or admin) can overwrite KV that engines may be reading. s3kv sends the
  # header on PutObject and CompleteMultipartUpload; CreateMultipartUpload and UploadPart
  # cannot carry it, and s3:ObjectCreationOperation is false for exactly those, so they pass.
  # CopyObject is refused (403; 501 with If-None-Match), and with it refresh on hit's self-copy:
  # no condition key names the request's own key, so a same-key copy cannot be exempted alone.
  dynamic "statement" {
    for_each = var.enforce_write_once ? [1] : []

    content {
      sid       = "DenyOverwritesUnderPrefix"
      effect    = "Deny"
      actions   = ["s3:PutObject"]
      resources = [local.objects_arn]

      principals {
        type        = "*"
        identifiers = ["*"]
      }

      condition {
        test     = "Null"
        variable = "s3:if-none-match"
        values   = ["true"]
      }

      condition {
        test     = "Bool"
        variable = "s3:ObjectCreationOperation"
        values   = ["true"]
      }
    }
  }
}

resource "aws_s3_bucket_policy" "this" {
  count = var.manage_bucket_policy && (var.require_tls || var.enforce_write_once) ? 1 : 0

  bucket = aws_s3_bucket.this.id
  policy = data.aws_iam_policy_document.bucket.json

  # Bucket sub-resource writes that run concurrently can fail with
  # OperationAborted ("conflicting conditional operation"); serialise them.
  depends_on = [
    aws_s3_bucket_public_access_block.this,
    aws_s3_bucket_ownership_controls.this,
  ]
}

# ListBucket is what lets S3 answer a HEAD/GET for a missing key with 404 instead of 403, so a
# cache miss is a miss and not an error. S3 evaluates that implicit check with s3:prefix set to
# the requested key, so the prefix condition still covers it; it also keeps `s3kv ls`/`gc`
# listings inside the prefix. Both roles need it.
data "aws_iam_policy_document" "engine" {
  # Engines read, write once, and abort their own failed multipart uploads. No DeleteObject:
  # an engine never deletes (write-once objects expire by lifecycle, or `s3kv gc` removes them).
  statement {
    sid       = "S3kvEngineObjects"
    effect    = "Allow"
    actions   = ["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload"]
    resources = [local.objects_arn]
  }

  statement {
    sid       = "S3kvListPrefix"
    effect    = "Allow"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.this.arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["${var.prefix}/*"]
    }
  }

  # Uploads need a data key, reads need Decrypt; kms:Encrypt is never called by S3 for SSE-KMS.
  dynamic "statement" {
    for_each = local.use_kms ? [var.kms_key_arn] : []

    content {
      sid       = "S3kvKmsViaS3"
      effect    = "Allow"
      actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
      resources = [statement.value]

      condition {
        test     = "StringEquals"
        variable = "kms:ViaService"
        values   = ["s3.${data.aws_region.current.name}.amazonaws.com"]
      }
    }
  }
}

data "aws_iam_policy_document" "operator" {
  # `s3kv ls`/`stats` list and HEAD, `verify` reads, `gc` and `verify --delete-bad` delete.
  # No PutObject: an operator never writes KV.
  statement {
    sid       = "S3kvOperatorObjects"
    effect    = "Allow"
    actions   = ["s3:GetObject", "s3:DeleteObject"]
    resources = [local.objects_arn]
  }

  statement {
    sid       = "S3kvListPrefix"
    effect    = "Allow"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.this.arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["${var.prefix}/*"]
    }
  }

  dynamic "statement" {
    for_each = local.use_kms ? [var.kms_key_arn] : []

    content {
      sid       = "S3kvKmsViaS3"
      effect    = "Allow"
      actions   = ["kms:Decrypt"]
      resources = [statement.value]

      condition {
        test     = "StringEquals"
        variable = "kms:ViaService"
        values   = ["s3.${data.aws_region.current.name}.amazonaws.com"]
      }
    }
  }
}

resource "aws_iam_policy" "engine" {
  count = var.create_iam ? 1 : 0

  name        = "${local.iam_policy_name}-engine"
  path        = var.iam_policy_path
  description = "s3kv engines: read and write-once KV under s3://${var.bucket_name}/${var.prefix}"
  policy      = data.aws_iam_policy_document.engine.json
  tags        = var.tags
}

resource "aws_iam_policy" "operator" {
  count = var.create_iam ? 1 : 0

  name        = "${local.iam_policy_name}-operator"
  path        = var.iam_policy_path
  description = "s3kv operators: list, verify and delete KV under s3://${var.bucket_name}/${var.prefix}"
  policy      = data.aws_iam_policy_document.operator.json
  tags        = var.tags
}

resource "aws_iam_role_policy_attachment" "engine" {
  for_each = var.create_iam ? toset(var.engine_role_names) : toset([])

  role       = each.value
  policy_arn = aws_iam_policy.engine[0].arn
}

resource "aws_iam_role_policy_attachment" "operator" {
  for_each = var.create_iam ? toset(var.operator_role_names) : toset([])

  role       = each.value
  policy_arn = aws_iam_policy.operator[0].arn
}
