"""Vision towers and projectors of image-text models: each turns an image's pixels into rows
the language model reads in place of the image's placeholder tokens (`VisionEncoder`); the
language models are the text families' own."""
