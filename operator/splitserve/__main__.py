from splitserve.cli import main

raise SystemExit(main())
