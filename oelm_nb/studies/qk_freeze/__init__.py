"The Q/K freeze study."
