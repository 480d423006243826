"The PCA embedding study."
