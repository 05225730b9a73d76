"""Acceptance tests of the command-line contract (SPEC section 3 and 4), run against the real console script.

A package so that its module names (``acceptance.test_cli`` ...) never clash with same-named test
modules in the other, package-less test folders.
"""
