import sys

from serving.cli import main

if __name__ == "__main__":  # a spawned engine process imports this module again
  sys.exit(main())
