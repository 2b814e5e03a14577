"""The evaluation harness (installed as ``abft.eval``): overhead benchmarks now; paired-replica
detection-coverage campaigns come with the evaluation issue."""
