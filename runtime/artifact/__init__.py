"""The engine directory contract: manifest and checksums, the checks a directory must pass, the build lock, the tokenizer, and loading the torch models from it."""
