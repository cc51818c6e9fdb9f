"""Tests of the repository itself: docs, paths named, the import graph, the mutation audit's rows."""
