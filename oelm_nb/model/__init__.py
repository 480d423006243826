"The model layer: devices, orthogonal layers, freezing, the GPT/OELM family, PCA embeddings, other weights."
