"""`python -m kvferry.tools.gpucheck`: the same as `kvferry gpu-check`."""

from kvferry.tools.gpucheck.run import main

raise SystemExit(main())
