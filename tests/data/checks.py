"""The Python tests' counting checks and their closing line ("N passed, M failed")."""

passed = failed = 0


def check(ok, message):
    """Counts one check; prints the message when it fails."""
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print("FAIL: " + message)


def finish():
    """Prints the closing line and returns the exit code."""
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0
