"""Model families and checkpoints against HF transformers and the release's reference, in fp32."""
