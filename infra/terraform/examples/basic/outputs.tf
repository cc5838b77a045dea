output "s3kv_url" {
  description = "Configure s3kv with this URL."
  value       = module.s3kv_bucket.s3kv_url
}

output "bucket_arn" {
  description = "ARN of the cache bucket."
  value       = module.s3kv_bucket.bucket_arn
}

output "policy_arn" {
  description = "ARN of the s3kv access policy."
  value       = module.s3kv_bucket.policy_arn
}
