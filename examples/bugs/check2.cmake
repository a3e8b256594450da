# The examples of the checks of docs/checking.md: each is run plainly
# and in check mode by run_bug_example.sh (see there).
# SOFTVERBS_CHECK_CALL_SITES: whether the reports name the call site
# symbolised (the checker's report does once it prints call sites).
option(SOFTVERBS_CHECK_CALL_SITES "examples/bugs tests require symbolised call sites in reports" ON)

if(SOFTVERBS_CHECK_CALL_SITES)
  set(check2_call_sites 1)
else()
  set(check2_call_sites 0)
endif()

set(check2_examples
  # example                      check id                      reports  call site functions
  "registered_memory_freed|registered-memory-freed|2|write_after_unmap write_after_free"
  "unacknowledged_events|unacknowledged-events|1|destroy_without_ack"
  "fork_with_registered_memory|fork-with-registered-memory|1|fork_child"
  "cq_overrun|cq-overrun|1|main"
  "access_rule_relaxed|access-rule|1|post_read"
)

foreach(entry IN LISTS check2_examples)
  string(REPLACE "|" ";" fields "${entry}")
  list(GET fields 0 example)
  list(GET fields 1 check_id)
  list(GET fields 2 count)
  list(GET fields 3 functions)
  separate_arguments(functions)
  add_executable(bug_${example} ${CMAKE_CURRENT_LIST_DIR}/${example}.c)
  target_link_libraries(bug_${example} PRIVATE PkgConfig::IBVERBS)
  # Symbolised call sites need the examples' own symbols.
  target_link_options(bug_${example} PRIVATE -rdynamic)
  target_compile_options(bug_${example} PRIVATE -g -O1 -fno-omit-frame-pointer)
  add_dependencies(bug_${example} softverbs softverbs_provider softverbs_preload softverbs_check_preload)
  add_test(NAME bug_${example}
    COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_bug_example.sh $<TARGET_FILE:softverbs> $<TARGET_FILE:bug_${example}>
            ${check_id} ${count} ${functions})
  set_tests_properties(bug_${example} PROPERTIES
    LABELS check
    TIMEOUT 60
    ENVIRONMENT "SOFTVERBS_RUNTIME_DIR=${CMAKE_CURRENT_BINARY_DIR}/bug_${example}.rt;EXPECT_CALL_SITES=${check2_call_sites};ASAN_OPTIONS=verify_asan_link_order=0")
endforeach()
