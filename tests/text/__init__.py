"""The torch-free text side: tokenizers, chat templates and DeepSeek's encoders, DSML replies."""
