locals {
  # Local mode: any endpoint override means an S3-compatible server (MinIO, SeaweedFS, moto ...).
  local_mode = var.s3_endpoint != null
  # A TLS-only bucket policy on a plain-http server would deny every request, the admin's too.
  require_tls = var.require_tls != null ? var.require_tls : !startswith(coalesce(var.s3_endpoint, "https://"), "http://")
}

provider "aws" {
  region = var.region

  # null (the default) leaves credentials to the provider's normal chain: AWS_ACCESS_KEY_ID /
  # AWS_SECRET_ACCESS_KEY, AWS_PROFILE, instance or IRSA roles. Set them only for a local server
  # whose keys you do not want in the environment.
  access_key = var.access_key
  secret_key = var.secret_key

  skip_credentials_validation = local.local_mode
  skip_requesting_account_id  = local.local_mode
  skip_metadata_api_check     = local.local_mode
  skip_region_validation      = local.local_mode
  s3_use_path_style           = local.local_mode

  endpoints {
    s3  = var.s3_endpoint
    iam = local.local_mode ? coalesce(var.iam_endpoint, var.s3_endpoint) : var.iam_endpoint
    sts = local.local_mode ? coalesce(var.sts_endpoint, var.s3_endpoint) : var.sts_endpoint
    kms = local.local_mode ? coalesce(var.kms_endpoint, var.s3_endpoint) : var.kms_endpoint
  }
}

module "s3kv_bucket" {
  source = "../../modules/s3kv-bucket"

  bucket_name                = var.bucket_name
  prefix                     = var.prefix
  force_destroy              = var.force_destroy
  expiration_days            = var.expiration_days
  kms_key_arn                = var.kms_key_arn
  require_tls                = local.require_tls
  enforce_write_once         = var.enforce_write_once
  create_iam                 = var.create_iam
  manage_public_access_block = var.manage_public_access_block
  manage_ownership_controls  = var.manage_ownership_controls
  manage_encryption          = var.manage_encryption
  manage_bucket_policy       = var.manage_bucket_policy
  engine_role_names          = var.engine_role_names
  operator_role_names        = var.operator_role_names
}
