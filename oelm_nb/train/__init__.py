"The training layer: checkpoints, the trainer and its guards, memory."
