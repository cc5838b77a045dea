locals {
  # Local mode: any endpoint override means a local S3-compatible server.
  local_mode = var.s3_endpoint != null
}

provider "aws" {
  region = var.region

  # Static dummy credentials only in local mode; on AWS the provider uses its
  # normal chain (env vars, profile, instance/IRSA role).
  access_key = local.local_mode ? "test" : null
  secret_key = local.local_mode ? "test" : null

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

  bucket_name     = var.bucket_name
  prefix          = var.prefix
  force_destroy   = var.force_destroy
  expiration_days = var.expiration_days
  kms_key_arn     = var.kms_key_arn
  allow_delete    = var.allow_delete
  role_names      = var.role_names
}
