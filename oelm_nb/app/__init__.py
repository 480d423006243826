"The application: `oelm` and `oelm doctor`."
