from cleave_export.cli import main

raise SystemExit(main())
