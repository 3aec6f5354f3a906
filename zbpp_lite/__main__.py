import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C in the first tenth of a second, before main takes the signals over
    print("zbpp_lite: interrupted (Ctrl-C)", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
