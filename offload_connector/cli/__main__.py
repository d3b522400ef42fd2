from offload_connector.cli.main import main

raise SystemExit(main())
