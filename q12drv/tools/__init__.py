"""Tools over the library: arena dumps (write, inspect, diff, render), the demo, the doctor, SASS, the soak,
and the ``q12drv`` command."""
