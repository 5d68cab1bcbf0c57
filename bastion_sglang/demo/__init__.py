"""`bastion demo`: the SmolLM2-135M-Instruct demo target, its committed drafters and a served demo request."""
