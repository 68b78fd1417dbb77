from mpsrun.cli import main

main()
