from dgemma.cli import main

raise SystemExit(main())
