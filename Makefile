# The two commands from the README:
#   make book   set up .venv and build the HTML book, executing every chapter
#   make test   set up .venv and run every test (package, nbval, book build, browser)
.PHONY: book test setup clean

book: setup
	bash scripts/build_book.sh

test: setup
	bash scripts/test.sh

setup:
	bash scripts/setup.sh

clean:
	rm -rf _build artifacts
