output "bucket_name" {
  description = "Name of the cache bucket."
  value       = aws_s3_bucket.this.id
}

output "bucket_arn" {
  description = "ARN of the cache bucket."
  value       = aws_s3_bucket.this.arn
}

output "prefix" {
  description = "Key prefix s3kv writes under (no slashes at either end)."
  value       = var.prefix
}

output "engine_policy_arn" {
  description = "ARN of the engine policy (read, write once, no delete); attach it to the inference nodes' roles. null when create_iam = false."
  value       = var.create_iam ? aws_iam_policy.engine[0].arn : null
}

output "operator_policy_arn" {
  description = "ARN of the operator policy (list, read, delete, no write) for `s3kv ls/stats/verify/gc`. null when create_iam = false."
  value       = var.create_iam ? aws_iam_policy.operator[0].arn : null
}

output "engine_policy_json" {
  description = "The engine policy document, for roles managed elsewhere (IRSA, a permission boundary) or a MinIO policy."
  value       = data.aws_iam_policy_document.engine.json
}

output "operator_policy_json" {
  description = "The operator policy document, for roles managed elsewhere or a MinIO policy."
  value       = data.aws_iam_policy_document.operator.json
}

output "s3kv_url" {
  description = "The URL to configure s3kv with (s3://<bucket>/<prefix>)."
  value       = "s3://${aws_s3_bucket.this.id}/${var.prefix}"
}

output "gc_command" {
  description = "The retention the cost estimates assume: run this with the operator policy (a CronJob every 10 minutes without --watch, or one long-running process). It deletes objects not written or refreshed on a hit for S3KV_RETENTION_H hours (default 1); the lifecycle rule above is the backstop. docs/operations.md#retention"
  value       = "s3kv gc --url s3://${aws_s3_bucket.this.id}/${var.prefix} --expired --yes --watch 10m"
}
