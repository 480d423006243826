"The Mercator KV distillation study: the loss, GSM8K, Hugging Face, the study, its report."
