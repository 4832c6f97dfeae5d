"""Pull mode: signed releases published as TUF channels on a static web server or bucket."""
