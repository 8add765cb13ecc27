"""Image and prompt processing: pixels -> patches, conversations -> token ids."""
