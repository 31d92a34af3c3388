// Added to Doxygen's MathJax configuration (MATHJAX_CODEFILE in docs/Doxyfile.in): no
// "Loading [MathJax]..." box in the corner of every page, formulas typeset quietly.
MathJax.Hub.Config({
  messageStyle: "none",
  SVG: {font: "TeX"},
});
