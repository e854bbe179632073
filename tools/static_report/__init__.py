"""The static performance report: every CUDA and Triton kernel compiled for sm_90a, read from ptxas's report and
the SASS, and its H100 time predicted at the benchmark shapes. Run `python -m tools.static_report` (see __main__.py);
`make test` runs it with --check where nvcc exists."""
