"The CVFP study: the fixed point, the method, its checks, the study, its report."
