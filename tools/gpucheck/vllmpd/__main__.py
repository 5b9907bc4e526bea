"""`python -m kvferry.tools.gpucheck.vllmpd`: the same as `kvferry gpu-check-vllm`."""

from kvferry.tools.gpucheck.vllmpd.cli import main

raise SystemExit(main())
