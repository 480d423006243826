"The lab layer: the study protocol and one run, status, the batch runner, benchmarks, clusters, precision, sampling, export."
