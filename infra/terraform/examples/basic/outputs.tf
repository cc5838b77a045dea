output "s3kv_url" {
  description = "Configure s3kv with this URL."
  value       = module.s3kv_bucket.s3kv_url
}

output "bucket_arn" {
  description = "ARN of the cache bucket."
  value       = module.s3kv_bucket.bucket_arn
}

output "engine_policy_arn" {
  description = "ARN of the engine policy (null when create_iam = false)."
  value       = module.s3kv_bucket.engine_policy_arn
}

output "operator_policy_arn" {
  description = "ARN of the operator policy (null when create_iam = false)."
  value       = module.s3kv_bucket.operator_policy_arn
}

output "engine_policy_json" {
  description = "The engine policy document (for MinIO, IRSA roles managed elsewhere ...)."
  value       = module.s3kv_bucket.engine_policy_json
}

output "operator_policy_json" {
  description = "The operator policy document."
  value       = module.s3kv_bucket.operator_policy_json
}

output "gc_command" {
  description = "Run this (operator role) for the 1-hour retention the cost estimates assume; the lifecycle rule is the backstop."
  value       = module.s3kv_bucket.gc_command
}
