"The data layer: the story corpus, tokenizers, token files."
