"""Real programs written by others, ported to jaxdist (see each module's header and the
"Real programs" table of docs/development.md); ``tests/test_programs.py`` runs each on 4
devices and on 1."""
