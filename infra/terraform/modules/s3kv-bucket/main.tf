data "aws_region" "current" {}

locals {
  # "prefix/" as seen by S3: the lifecycle filter, the object ARN and the
  # ListBucket condition all anchor on it, so "s3kv" never matches "s3kv-other/".
  key_prefix      = "${var.prefix}/"
  objects_arn     = "${aws_s3_bucket.this.arn}/${var.prefix}/*"
  use_kms         = var.kms_key_arn != null
  iam_policy_name = coalesce(var.iam_policy_name, "s3kv-${var.bucket_name}")

  object_actions = concat(
    [
      "s3:GetObject",
      "s3:PutObject",
      "s3:AbortMultipartUpload",
      "s3:ListMultipartUploadParts",
    ],
    var.allow_delete ? ["s3:DeleteObject"] : [],
  )
}

resource "aws_s3_bucket" "this" {
  bucket        = var.bucket_name
  force_destroy = var.force_destroy
  tags          = var.tags
}

resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket = aws_s3_bucket.this.id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
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
  statement {
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

resource "aws_s3_bucket_policy" "this" {
  bucket = aws_s3_bucket.this.id
  policy = data.aws_iam_policy_document.bucket.json

  # Bucket sub-resource writes that run concurrently can fail with
  # OperationAborted ("conflicting conditional operation"); serialise them.
  depends_on = [
    aws_s3_bucket_public_access_block.this,
    aws_s3_bucket_ownership_controls.this,
  ]
}

data "aws_iam_policy_document" "access" {
  statement {
    sid       = "S3kvObjects"
    effect    = "Allow"
    actions   = local.object_actions
    resources = [local.objects_arn]
  }

  # ListBucket is what lets S3 answer a HEAD/GET for a missing key with 404
  # instead of 403, so a cache miss is a miss and not an error. S3 evaluates
  # that implicit check with s3:prefix set to the requested key, so the prefix
  # condition still covers it; it also keeps `s3kv ls`/`gc` inside the prefix.
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

  # ListMultipartUploads (used by gc to find stale uploads) has no s3:prefix
  # condition key, so a prefix condition would never match. It lists only the
  # keys and ids of uploads in flight, never object data.
  statement {
    sid       = "S3kvListMultipartUploads"
    effect    = "Allow"
    actions   = ["s3:ListBucketMultipartUploads"]
    resources = [aws_s3_bucket.this.arn]
  }

  dynamic "statement" {
    for_each = local.use_kms ? [var.kms_key_arn] : []

    content {
      sid       = "S3kvKmsViaS3"
      effect    = "Allow"
      actions   = ["kms:Encrypt", "kms:Decrypt", "kms:GenerateDataKey"]
      resources = [statement.value]

      condition {
        test     = "StringEquals"
        variable = "kms:ViaService"
        values   = ["s3.${data.aws_region.current.name}.amazonaws.com"]
      }
    }
  }
}

resource "aws_iam_policy" "access" {
  name        = local.iam_policy_name
  path        = var.iam_policy_path
  description = "s3kv KV-cache access to s3://${var.bucket_name}/${var.prefix}"
  policy      = data.aws_iam_policy_document.access.json
  tags        = var.tags
}

resource "aws_iam_role_policy_attachment" "access" {
  for_each = toset(var.role_names)

  role       = each.value
  policy_arn = aws_iam_policy.access.arn
}
