from kvferry.cli import main

raise SystemExit(main())
