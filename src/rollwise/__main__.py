from rollwise.cli import main

main()
