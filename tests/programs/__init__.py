"""Real programs written by others, ported to jaxdist (see each module's header and README's
"Real programs" table); ``tests/test_programs.py`` runs each on 4 devices and on 1."""
