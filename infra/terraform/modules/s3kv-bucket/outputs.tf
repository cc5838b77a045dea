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

output "policy_arn" {
  description = "ARN of the IAM policy granting s3kv access to the prefix; attach it to the inference nodes' roles."
  value       = aws_iam_policy.access.arn
}

output "policy_json" {
  description = "The IAM policy document, for use in a permission boundary or an IRSA role outside this module."
  value       = data.aws_iam_policy_document.access.json
}

output "s3kv_url" {
  description = "The URL to configure s3kv with (s3://<bucket>/<prefix>)."
  value       = "s3://${aws_s3_bucket.this.id}/${var.prefix}"
}
