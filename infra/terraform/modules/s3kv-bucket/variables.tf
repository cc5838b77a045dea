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

  validation {
    condition     = length(var.prefix) > 0 && !startswith(var.prefix, "/") && !endswith(var.prefix, "/") && !strcontains(var.prefix, "//") && !strcontains(var.prefix, "*")
    error_message = "prefix must be non-empty, must not start or end with '/', and must not contain '//' or '*'."
  }
}

variable "force_destroy" {
  description = "Allow `terraform destroy` to delete the bucket even when it still holds cache objects. Leave false for shared caches."
  type        = bool
  default     = false
}

variable "expiration_days" {
  description = "Days after creation at which a cache object under the prefix expires (lifecycle rule). s3kv objects are write-once, so this bounds both storage cost and the age of any served KV."
  type        = number
  default     = 30

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
  description = "ARN of a KMS key for SSE-KMS (with an S3 Bucket Key, which cuts KMS request cost). null (default) uses SSE-S3 (AES256). When set, the IAM policy also grants kms:Encrypt, kms:Decrypt and kms:GenerateDataKey on this key, only via S3."
  type        = string
  default     = null

  validation {
    condition     = var.kms_key_arn == null || can(regex("^arn:[a-z0-9-]+:kms:", var.kms_key_arn))
    error_message = "kms_key_arn must be null or a KMS key ARN (arn:<partition>:kms:...)."
  }
}

variable "allow_delete" {
  description = "Grant s3:DeleteObject on the prefix (needed by `s3kv gc`). Set false for read/write-only clients that must never delete."
  type        = bool
  default     = true
}

variable "iam_policy_name" {
  description = "Name of the IAM policy that grants s3kv access to the prefix. null (default) derives \"s3kv-<bucket_name>\"."
  type        = string
  default     = null

  validation {
    condition     = var.iam_policy_name == null || can(regex("^[A-Za-z0-9+=,.@_-]{1,128}$", var.iam_policy_name))
    error_message = "iam_policy_name must be 1-128 characters of letters, digits and +=,.@_-."
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

variable "role_names" {
  description = "Names of existing IAM roles (e.g. the inference nodes' instance or IRSA roles) to attach the s3kv policy to. Empty (default) attaches nothing."
  type        = list(string)
  default     = []
}

variable "tags" {
  description = "Tags applied to the bucket and the IAM policy."
  type        = map(string)
  default     = {}
}
