# Programs wrong only under reordering or early placement: they pass on a
# plain run and fail under `softverbs run --adversarial=SEED`, the same seed
# failing again (tests/adversarial_examples.sh).
foreach(example reads_before_completion assumes_cq_order)
  add_executable(${example} ${CMAKE_CURRENT_LIST_DIR}/${example}.cpp)
  target_link_libraries(${example} PRIVATE PkgConfig::IBVERBS Threads::Threads)
  set_target_properties(${example} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin/examples/bugs)
  if(SOFTVERBS_BUILD_TESTS)
    add_test(NAME adversarial_example_${example}
      COMMAND ${CMAKE_CURRENT_LIST_DIR}/adversarial_example.sh $<TARGET_FILE:softverbs> $<TARGET_FILE:${example}>)
    set_tests_properties(adversarial_example_${example} PROPERTIES
      LABELS tools
      TIMEOUT 120
      ENVIRONMENT "SOFTVERBS_RUNTIME_DIR=${CMAKE_CURRENT_BINARY_DIR}/adversarial_example_${example}.rt")
  endif()
endforeach()
