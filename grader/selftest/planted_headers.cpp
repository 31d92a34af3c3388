// planted_headers.cpp: the one source of dp_planted_headers (grader/CMakeLists.txt), the
// target that owns the precompiled runtime headers the planted bugs share. It has no code
// of its own: a library needs a source to compile its precompiled header with.
