variable "bucket_name" {
  description = "Name of the S3 bucket that holds the s3kv prompt cache. Must be globally unique (3-63 characters: lowercase letters, digits, dots, hyphens)."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name must be 3-63 characters of lowercase letters, digits, '.' and '-', starting and ending with a letter or digit."
  }
}

variable "prefix" {
  description = "Key prefix under which s3kv stores its objects (the path part of the s3kv URL, s3://<bucket>/<prefix>). No leading or trailing slash; inner slashes are allowed (e.g. \"team-a/s3kv\")."
  type        = string
  default     = "s3kv"

  # '*' and '?' are wildcards in the ARN and the s3:prefix condition: "team?" would also grant
  # "teamX/". '#' and '?' also break the s3:// URL the prefix ends up in.
  validation {
    condition     = length(var.prefix) > 0 && !startswith(var.prefix, "/") && !endswith(var.prefix, "/") && !strcontains(var.prefix, "//") && length(regexall("[*?#]", var.prefix)) == 0
    error_message = "prefix must be non-empty, must not start or end with '/', and must not contain '//', '*', '?' or '#'."
  }
}

variable "force_destroy" {
  description = "Allow `terraform destroy` to delete the bucket even when it still holds cache objects. Leave false for shared caches."
  type        = bool
  default     = false
}

variable "expiration_days" {
  description = "Days after creation at which a cache object under the prefix expires (lifecycle rule): the backstop. s3kv's own retention (`s3kv gc --expired --watch 10m`, 1 hour after the last write or refresh by default; docs/operations.md) deletes far sooner -- S3 lifecycle rules count whole days, while 99% of prefix reuse in conversation traces comes within 26 minutes. 1 (the smallest a rule allows) bounds the bill if the gc stops."
  type        = number
  default     = 1

  validation {
    condition     = var.expiration_days > 0 && floor(var.expiration_days) == var.expiration_days
    error_message = "expiration_days must be a whole number greater than 0."
  }
}

variable "abort_incomplete_multipart_days" {
  description = "Days after initiation at which an incomplete multipart upload under the prefix is aborted (its parts are billed until then). s3kv uploads large chunks as multipart; a worker that dies mid-upload leaves parts behind."
  type        = number
  default     = 1

  validation {
    condition     = var.abort_incomplete_multipart_days > 0 && floor(var.abort_incomplete_multipart_days) == var.abort_incomplete_multipart_days
    error_message = "abort_incomplete_multipart_days must be a whole number greater than 0."
  }
}

variable "kms_key_arn" {
  description = "ARN of a KMS key for SSE-KMS (with an S3 Bucket Key, which cuts KMS request cost). null (default) uses SSE-S3 (AES256). When set, the engine policy also grants kms:GenerateDataKey and kms:Decrypt, the operator policy kms:Decrypt, on this key and only via S3."
  type        = string
  default     = null

  validation {
    condition     = var.kms_key_arn == null || can(regex("^arn:[a-z0-9-]+:kms:", var.kms_key_arn))
    error_message = "kms_key_arn must be null or a KMS key ARN (arn:<partition>:kms:...)."
  }
}

variable "require_tls" {
  description = "Bucket policy: deny every request that does not use TLS. Turn off only for a local server reached over plain http (it would lock everyone out)."
  type        = bool
  default     = true
}

variable "enforce_write_once" {
  description = "Bucket policy: deny creating an object under the prefix without If-None-Match (s3:if-none-match), so no one can overwrite KV that engines read. s3kv always sends it on writes, but it also refuses CopyObject, which refresh on hit (S3KV_REFRESH_ON_HIT, on by default) needs: set false to keep hot prefixes alive under s3kv gc --expired."
  type        = bool
  default     = true
}

variable "create_iam" {
  description = "Create the engine and operator IAM policies (and attach them to the roles below). false for S3-compatible servers without IAM (MinIO, SeaweedFS ...): the policy documents are still output as JSON."
  type        = bool
  default     = true
}

variable "manage_public_access_block" {
  description = "Create the bucket's public access block (all four flags on). false for servers without that API."
  type        = bool
  default     = true
}

variable "manage_ownership_controls" {
  description = "Set object ownership to BucketOwnerEnforced (ACLs off). false for servers without that API."
  type        = bool
  default     = true
}

variable "manage_encryption" {
  description = "Set default server-side encryption (SSE-S3, or SSE-KMS with kms_key_arn). false for servers without it."
  type        = bool
  default     = true
}

variable "manage_bucket_policy" {
  description = "Attach the bucket policy (TLS only; write once). false for servers without bucket policies."
  type        = bool
  default     = true
}

variable "iam_policy_name" {
  description = "Base name of the IAM policies; \"-engine\" and \"-operator\" are appended. null (default) derives \"s3kv-<bucket_name>\"."
  type        = string
  default     = null

  validation {
    condition     = var.iam_policy_name == null || can(regex("^[A-Za-z0-9+=,.@_-]{1,119}$", var.iam_policy_name))
    error_message = "iam_policy_name must be 1-119 characters of letters, digits and +=,.@_- (a suffix such as -operator is appended)."
  }
}

variable "iam_policy_path" {
  description = "IAM path of the policy."
  type        = string
  default     = "/"

  validation {
    condition     = startswith(var.iam_policy_path, "/") && endswith(var.iam_policy_path, "/")
    error_message = "iam_policy_path must begin and end with '/'."
  }
}

variable "engine_role_names" {
  description = "Existing IAM roles of the inference engines (instance or IRSA roles) to attach the engine policy to: read and write-once, no delete."
  type        = list(string)
  default     = []
}

variable "operator_role_names" {
  description = "Existing IAM roles of operators (people or jobs running `s3kv ls/stats/verify/gc`) to attach the operator policy to: list, read, delete, no write."
  type        = list(string)
  default     = []
}

variable "tags" {
  description = "Tags applied to the bucket and the IAM policies."
  type        = map(string)
  default     = {}
}
