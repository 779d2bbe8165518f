"""nbval: pictures (SVG, PNG) and stderr (progress bars, library warnings) are not compared."""


def pytest_collectstart(collector):
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("image/svg+xml", "text/html", "stderr")
