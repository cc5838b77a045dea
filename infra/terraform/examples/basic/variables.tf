variable "region" {
  description = "AWS region of the bucket."
  type        = string
  default     = "us-east-1"
}

variable "bucket_name" {
  description = "Name of the cache bucket (globally unique on AWS)."
  type        = string
}

variable "prefix" {
  description = "Key prefix for s3kv objects (no leading/trailing slash)."
  type        = string
  default     = "s3kv"
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete a non-empty bucket."
  type        = bool
  default     = false
}

variable "expiration_days" {
  description = "Days after which cache objects expire."
  type        = number
  default     = 30
}

variable "kms_key_arn" {
  description = "KMS key ARN for SSE-KMS; null uses SSE-S3 (AES256)."
  type        = string
  default     = null
}

variable "allow_delete" {
  description = "Grant s3:DeleteObject on the prefix (needed by `s3kv gc`)."
  type        = bool
  default     = true
}

variable "role_names" {
  description = "Existing IAM roles to attach the s3kv access policy to."
  type        = list(string)
  default     = []
}

# --- Local S3 server (moto, MinIO, LocalStack, ...) --------------------------
# Leave all of these null to talk to AWS with the normal credential chain.
# Setting s3_endpoint switches the provider to "local" mode: static test
# credentials, path-style addressing and no calls to STS/EC2 metadata.

variable "s3_endpoint" {
  description = "S3 endpoint URL override, e.g. http://127.0.0.1:5000. null = AWS."
  type        = string
  default     = null
}

variable "iam_endpoint" {
  description = "IAM endpoint URL override. null = AWS (or s3_endpoint in local mode)."
  type        = string
  default     = null
}

variable "sts_endpoint" {
  description = "STS endpoint URL override. null = AWS (or s3_endpoint in local mode)."
  type        = string
  default     = null
}

variable "kms_endpoint" {
  description = "KMS endpoint URL override. null = AWS (or s3_endpoint in local mode)."
  type        = string
  default     = null
}
