"""Images in prompts: decoding, preprocessing, where their rows go, and the vision half of a checkpoint."""
