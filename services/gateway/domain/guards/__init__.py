"""Guards the gateway runs on prompts and answers: PII masking, prompt-injection screen."""
