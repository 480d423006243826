"The studies, each a folder of its own (method, study, report), registered by entry point; none knows another."
