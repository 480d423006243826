"The report layer: the evidence kit, convergence and formation, run tables, pages, the explorer (no torch)."
