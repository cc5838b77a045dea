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
  description = "Days after which cache objects expire (backstop; s3kv gc --expired runs the 1-hour retention)."
  type        = number
  default     = 1
}

variable "kms_key_arn" {
  description = "KMS key ARN for SSE-KMS; null uses SSE-S3 (AES256)."
  type        = string
  default     = null
}

variable "require_tls" {
  description = "Bucket policy: TLS only. null = on, except for an http:// s3_endpoint (a local server without TLS)."
  type        = bool
  default     = null
}

variable "enforce_write_once" {
  description = "Bucket policy: creating an object under the prefix needs If-None-Match."
  type        = bool
  default     = true
}

variable "engine_role_names" {
  description = "Existing IAM roles of the inference engines (read, write once, no delete)."
  type        = list(string)
  default     = []
}

variable "operator_role_names" {
  description = "Existing IAM roles that run s3kv ls/stats/verify/gc (list, read, delete)."
  type        = list(string)
  default     = []
}

# --- S3-compatible servers (MinIO, SeaweedFS, moto, LocalStack ...) ----------
# Leave the endpoints null to talk to AWS with the normal credential chain.
# Setting s3_endpoint switches the provider to "local" mode: path-style
# addressing and no calls to STS or EC2 metadata. Credentials still come from
# the normal chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) unless set below.

variable "s3_endpoint" {
  description = "S3 endpoint URL override, e.g. http://127.0.0.1:9000. null = AWS."
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

variable "access_key" {
  description = "Access key for the provider. null = the normal chain (AWS_ACCESS_KEY_ID, profile, role)."
  type        = string
  default     = null
  sensitive   = true
}

variable "secret_key" {
  description = "Secret key for the provider. null = the normal chain (AWS_SECRET_ACCESS_KEY, profile, role)."
  type        = string
  default     = null
  sensitive   = true
}

variable "create_iam" {
  description = "Create the IAM policies. false for servers without IAM (MinIO, SeaweedFS): use the *_policy_json outputs there."
  type        = bool
  default     = true
}

variable "manage_public_access_block" {
  description = "Create the public access block. false for servers without that API."
  type        = bool
  default     = true
}

variable "manage_ownership_controls" {
  description = "Set BucketOwnerEnforced ownership. false for servers without that API."
  type        = bool
  default     = true
}

variable "manage_encryption" {
  description = "Set default server-side encryption. false for servers without it."
  type        = bool
  default     = true
}

variable "manage_bucket_policy" {
  description = "Attach the bucket policy (TLS only, write once). false for servers without bucket policies."
  type        = bool
  default     = true
}
